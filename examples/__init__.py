"""Programs a user copies: each runs as a script (`python examples/NAME.py`) and imports
hsq and a trainer, never the other way (tests/test_layers.py). A package only so that
mypy checks them with the rest."""
