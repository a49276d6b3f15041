"""Worker daemons: one per inference server, owning a private dump dir."""
