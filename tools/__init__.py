"""Tools the model may call (read, write, edit, bash, grep, git, outline).

Not built yet (see the agent issue); this package imports nothing of ours.
"""
