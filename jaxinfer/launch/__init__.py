"""Command-line entry points (`python -m jaxinfer.launch.<name>`)."""
