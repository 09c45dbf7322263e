"""From a Slurm allocation to a Ray cluster, and the right GPU for each training worker (see README.md)."""
