"""What changed between the pinned SGLang releases for the dump hook, read from each
version's wheel (as tests/test_sglang_conformance.py does): the form of DeepSeek/Kimi's
aux states (a list of K tensors, or one packed [T, K*H] tensor from 0.5.17) and the prefill
CUDA-graph backends (`tc_piecewise` leaves the choices in 0.5.22). compat's tables must say
what the source says; the hook's tap takes both aux forms (tests/test_sglang_hook.py)."""

from __future__ import annotations

import ast
import re
import zipfile

import pytest

from hsq.engines.sglang import compat
from hsq.engines.sglang.compat import PINNED_VERSIONS
from tests.support.sglangsrc import CACHE, wheel_reader

PREFILL_GRAPH_VERSIONS = [
    v for v in PINNED_VERSIONS if compat.parse_version(v) >= compat.PREFILL_GRAPH_FLAG_SINCE
]


@pytest.mark.parametrize("version", PINNED_VERSIONS)
def test_deepseek_aux_form_matches_the_source(version: str) -> None:
    for read in wheel_reader(version):
        text = read("sglang/srt/models/deepseek_v2.py")
        assert text is not None
        packed = "AuxHiddenStatePacker(" in text and ".finalize()" in text
        assert packed == compat.deepseek_packs_aux(version), version
        if not packed:  # the list form: the model returns its aux list as it built it
            assert "return hidden_states, aux_hidden_states" in text, version


@pytest.mark.parametrize("version", PREFILL_GRAPH_VERSIONS)
def test_prefill_graph_backends_match_the_source(version: str) -> None:
    for read in wheel_reader(version):
        text = read("sglang/srt/model_executor/cuda_graph_config.py")
        assert text is not None
        tree = ast.parse(text)
        allowed = next(
            n.value
            for n in ast.walk(tree)
            if isinstance(n, ast.Assign)
            and any(
                isinstance(t, ast.Name) and t.id == "ALLOWED_BACKENDS_PER_PHASE" for t in n.targets
            )
        )
        assert isinstance(allowed, ast.Dict)
        prefill = next(
            v
            for k, v in zip(allowed.keys, allowed.values, strict=True)
            if k is not None and ast.unparse(k) == "Phase.PREFILL"
        )
        names = re.findall(r"Backend\.(\w+)", ast.unparse(prefill))
        values = dict(re.findall(r'^\s+(\w+) = "(\w+)"$', text, flags=re.M))
        assert tuple(sorted(values[n] for n in names)) == tuple(
            sorted(compat.prefill_graph_backends(version))
        ), version
        assert "disabled" in compat.prefill_graph_backends(version)  # what the hook accepts


@pytest.mark.parametrize("version", PREFILL_GRAPH_VERSIONS)
def test_the_prefill_graph_off_flag_exists(version: str) -> None:
    """`hsq launch-sglang` passes compat.prefill_graph_off_flags(version): each must be a
    ServerArgs field of that version."""
    for _ in wheel_reader(version):  # skips (or fails under CI) without the wheel
        wheel = sorted(CACHE.glob(f"sglang-{version}-*.whl"))[0]
        fields: set[str] = set()
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():  # 0.5.20 moved the fields to arg_groups/fields/
                if name == "sglang/srt/server_args.py" or (
                    name.startswith("sglang/srt/arg_groups/") and name.endswith(".py")
                ):
                    text = zf.read(name).decode()
                    fields |= set(re.findall(r"^\s+(\w+): A\[", text, flags=re.M))
        for flag in compat.prefill_graph_off_flags(version):
            assert flag.removeprefix("--").replace("-", "_") in fields, (version, flag)


def test_live_versions_are_pinned() -> None:
    assert set(compat.LIVE_VERSIONS) <= set(PINNED_VERSIONS)
