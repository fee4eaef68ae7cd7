"""Row ids in a fixed amount of memory: their hash, the uniqueness check, RESUME's done set."""
