"""Integrations with training frameworks; each module imports its framework, so import it only when used."""
