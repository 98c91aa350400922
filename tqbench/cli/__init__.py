"""The Typer command line: renders engine results with rich (progress on stderr, results and --json on stdout)."""
