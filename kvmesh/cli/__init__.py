"""Command-line interface (`kvmesh ...`)."""
