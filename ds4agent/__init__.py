"""ds4-agent: the application layer (Textual TUI, agent loop, slash commands, HTTP shim)."""
