"""Input pipelines: `batches`, `shuffled`, Grain's iterators, and the checks and placement of one batch."""
