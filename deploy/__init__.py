"""Deployment helpers (monitoring stack without Docker, dashboard rendering, model fetching)."""
