"""The application shell: the `hsq` command and the operator functions behind it. It may
import every layer (docs/architecture.md)."""
