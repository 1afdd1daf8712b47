"""Requests, the step loop and the user-facing LLM class."""
