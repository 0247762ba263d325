"""The command-line tools, one module each (`mcar <tool>`, mcar/cli.py). A tool module holds its command line and
the glue of its job; what two tools share lives a layer down (eval, train, data, ...), so no tool imports another
(the import-linter contract in pyproject.toml)."""
