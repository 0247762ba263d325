"""The Hydra configs of every mcar tool, shipped inside the package (`pkg://mcar.conf`)."""
