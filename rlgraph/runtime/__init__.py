"""Running a compiled plan on Ray: the data plane, the scheduler and the workers."""
