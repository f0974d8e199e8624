"""Operating pools outside a run: servers kept up for other runs (``serve``), and the checks before one (``provision``)."""
