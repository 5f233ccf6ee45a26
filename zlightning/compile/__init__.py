"""Reserved for a later issue (see the project issues)."""
