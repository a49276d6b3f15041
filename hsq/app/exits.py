"""`hsq`'s exit codes (docs/operations.md): what a script calling it can branch on."""

EXIT_OK = 0
EXIT_PROBLEMS = 1
"""Problems found (verify, audit, export), or an expected failure of the work itself."""
EXIT_USAGE = 2
"""A usage or configuration error: nothing was changed."""
EXIT_REDIS = 3
"""Redis unreachable."""
