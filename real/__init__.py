"""The real executor: runs Programs with torch (imported lazily) on a GPU or the CPU."""
