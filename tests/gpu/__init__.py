"""GPU tests: hsq against a live SGLang server (`pytest -m gpu tests/gpu`, through
scripts/sglang_live.sh on a GPU machine). Skipped with a reason without CUDA or SGLang;
`make test` deselects them (pyproject: `-m 'not gpu'`)."""
