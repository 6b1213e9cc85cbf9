"""Reporting: tables and plots built only from run folders (metrics.jsonl, summary.json)."""
