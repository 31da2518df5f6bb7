"""The device step: pure JAX programs over explicit state, donated through every call
(docs/layout.md lists the modules, docs/architecture.md describes the step)."""
