"""The producer: validates a dataset and enqueues the sample ids not yet done."""
