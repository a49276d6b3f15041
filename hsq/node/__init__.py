"""`hsq run`'s orchestration of one node: its Redis, its plan, its children, its view."""
