"""Small helpers shared by the entry points and the scheduler process (they import nothing of the engine)."""
