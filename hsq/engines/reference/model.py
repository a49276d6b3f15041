"""A real transformer that yields EAGLE-3 hidden states: aux layers plus the post-norm state
(and, with `prenorm`, the final layer's output before the norm).

`tiny` is a seeded, randomly initialised Llama small enough for CPU tests; building it
twice gives the same weights, so any two server processes return bit-identical states.
A path loads a local HF checkpoint (no hub access at run time).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hsq.dump.format import ModelIdentity
from hsq.engines.common import config_digest
from hsq.engines.reference.shapes import eagle3_default_layers, shape_config
from hsq.errors import ConfigError

PRENORM_KEY = -1
"""Where the final norm's pre-hook leaves its input among the captured layers."""


def bucket_length(n: int) -> int:
    """Multiples of 128 up to 1024, then of 512: about 22 shapes up to 8k tokens."""
    step = 128 if n <= 1024 else 512
    return -(-n // step) * step


def batch_shapes(max_len: int, max_requests: int, max_tokens: int) -> list[tuple[int, int]]:
    """Every padded (rows, bucket length) a batching engine can run on the GPU, largest
    first: B rows of longest request n need B * n <= max_tokens (one request always runs)."""
    out: list[tuple[int, int]] = []
    prev = 0
    length = bucket_length(1)
    while prev < max_len:
        rows = max(1, min(max_requests, max_tokens // (prev + 1)))
        out.extend((b, length) for b in range(1, rows + 1))
        prev, length = length, bucket_length(length + 1)
    return sorted(out, key=lambda s: s[0] * s[1], reverse=True)


@dataclass(frozen=True)
class Captured:
    aux: torch.Tensor
    """[T, k*H] on the model's device, in the dump dtype."""
    last: torch.Tensor
    """[T, H] post-norm final state, on the model's device, in the dump dtype."""
    prenorm: torch.Tensor | None = None
    """[T, H] the final layer's output entering the final norm (only with `prenorm`)."""


class HiddenStateModel:
    """Runs the decoder stack only (no LM head) and taps the inputs of the aux layers."""

    def __init__(
        self,
        decoder: nn.Module,
        identity: ModelIdentity,
        layer_ids: list[int],
        device: torch.device,
        dump_dtype: torch.dtype,
        *,
        prenorm: bool = False,
    ) -> None:
        layers = decoder.get_submodule("layers")
        assert isinstance(layers, nn.ModuleList), "expected an HF decoder with .layers"
        n = len(layers)
        bad = [i for i in layer_ids if not 0 <= i < n]
        if bad or not layer_ids:
            raise ConfigError(f"layer ids {layer_ids} must be non-empty and within [0, {n})")
        self.decoder = decoder
        self.identity = identity
        self.layer_ids = list(layer_ids)
        self.device = device
        self.dump_dtype = dump_dtype
        embed = decoder.get_submodule("embed_tokens")
        assert isinstance(embed, nn.Embedding), "expected an HF decoder with .embed_tokens"
        self.vocab_size = int(embed.num_embeddings)
        self._captured: dict[int, torch.Tensor] = {}
        for i in sorted(set(layer_ids)):
            layers[i].register_forward_pre_hook(self._tap(i), with_kwargs=True)
        self.prenorm = prenorm
        if prenorm:
            # The final norm's input is the last decoder layer's output: the residual stream
            # after the whole stack, before the norm (HF never returns it).
            decoder.get_submodule("norm").register_forward_pre_hook(
                self._tap(PRENORM_KEY), with_kwargs=True
            )

    def _tap(self, i: int) -> Callable[..., None]:
        # A pre-hook sees the residual stream *entering* layer i, i.e. HF hidden_states[i].
        def hook(_mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self._captured[i] = args[0] if args else kwargs["hidden_states"]

        return hook

    @property
    def hidden_size(self) -> int:
        return self.identity.hidden_size

    def forward(self, input_ids: list[int]) -> Captured:
        return self.forward_batch([input_ids])

    @torch.inference_mode()
    def forward_batch(self, seqs: list[list[int]]) -> Captured:
        """One forward over B requests; the states come back packed in request order
        ([sum of lengths, ...]), so one device-to-host copy serves the whole batch."""
        lengths = [len(s) for s in seqs]
        longest = max(lengths)
        padded = bucket_length(longest) if self.device.type == "cuda" else longest
        # Causal attention: tokens appended after an input cannot change its states, so
        # right-padding every row to one (bucket) length is exact without an attention
        # mask, and the GPU path sees few shapes (a new length took a median 78 ms against
        # 21 ms for a repeated one).
        rows = [s + [0] * (padded - len(s)) for s in seqs]
        ids = torch.tensor(rows, dtype=torch.long)
        if self.device.type == "cuda":
            # Pinned and asynchronous: a copy from pageable memory waits for the device to
            # finish the previous forward, so this one could not be queued behind it.
            ids = ids.pin_memory().to(self.device, non_blocking=True)
        self._captured.clear()
        try:
            out = self.decoder(input_ids=ids, use_cache=False)
            aux_all = torch.cat([self._captured[i] for i in self.layer_ids], dim=-1)
            last_all = out.last_hidden_state
            pre_all = self._captured[PRENORM_KEY] if self.prenorm else None
        finally:
            self._captured.clear()

        def unpad(x: torch.Tensor) -> torch.Tensor:
            if len(seqs) == 1:
                return x[0, :longest].to(self.dump_dtype)
            return torch.cat([x[b, :n] for b, n in enumerate(lengths)]).to(self.dump_dtype)

        return Captured(
            aux=unpad(aux_all),
            last=unpad(last_all),
            prenorm=unpad(pre_all) if pre_all is not None else None,
        )


def _headless(auto: Any, config: Any) -> Any:
    """The decoder class AutoModel picks for `config`, told that a checkpoint's LM head is
    not its to load: a *ForCausalLM checkpoint's `lm_head.*` otherwise fills a `LOAD REPORT
    ... UNEXPECTED` warning at every start. Any other unexpected or missing key is still
    reported. AutoModel itself where the mapping has no class for the config."""
    from transformers import MODEL_MAPPING

    try:
        base: Any = MODEL_MAPPING[type(config)]
    except (KeyError, ValueError):
        return auto
    if not isinstance(base, type):  # a mapping to several classes: AutoModel picks
        return auto
    ignored = [*(getattr(base, "_keys_to_ignore_on_load_unexpected", None) or []), r"^lm_head\."]
    return type(base.__name__, (base,), {"_keys_to_ignore_on_load_unexpected": ignored})


def load_model(
    source: str,
    *,
    device: str,
    dtype: torch.dtype,
    dump_dtype: torch.dtype,
    layers: list[int] | None,
    seed: int = 0,
    prenorm: bool = False,
) -> HiddenStateModel:
    """Build `tiny` (or a named random shape such as `llama-8b`) or load a local checkpoint."""
    from transformers import AutoConfig, AutoModel, LlamaConfig, LlamaModel

    dev = torch.device(device)
    path = Path(source)
    if path.exists():
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        decoder = _headless(AutoModel, config).from_pretrained(
            path, local_files_only=True, dtype=dtype
        )
        cfg_dict = config.to_dict()
        name = path.name
    else:
        cfg_dict = shape_config(source)
        config = LlamaConfig(**cfg_dict)
        # Weights come from a fixed seed, so every process builds the same model.
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            torch.manual_seed(seed)
            if dev.type == "cuda":
                # Initialise on the GPU in the compute dtype: an 8B model's random init on
                # the CPU takes minutes and 32 GB of host memory.
                with torch.device(dev):
                    decoder = LlamaModel._from_config(config, dtype=dtype)  # type: ignore[no-untyped-call]
            else:
                decoder = LlamaModel(config)
        name = f"{source}-seed{seed}"
    decoder = decoder.to(device=dev, dtype=dtype).eval()
    num_layers = int(config.num_hidden_layers)
    identity = ModelIdentity(
        name=name,
        architecture=type(decoder).__name__,
        num_layers=num_layers,
        hidden_size=int(config.hidden_size),
        config_digest=config_digest(cfg_dict, f"seed={seed}" if not path.exists() else ""),
    )
    return HiddenStateModel(
        decoder,
        identity,
        layers if layers is not None else eagle3_default_layers(num_layers),
        dev,
        dump_dtype,
        prenorm=prenorm,
    )
