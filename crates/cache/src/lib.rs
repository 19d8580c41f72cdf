//! A generic metadata cache for qcow2 L2 slices and refcount blocks (built in issue 3).
