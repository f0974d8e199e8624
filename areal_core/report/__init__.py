"""Reports that compare finished runs: tables and plots (``compare``), and the Prefect UI's artifacts (``ui``)."""
