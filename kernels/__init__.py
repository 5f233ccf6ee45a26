"""Native kernels (later issue)."""
