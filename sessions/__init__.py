"""Sessions on disk: the ds4 KV file format and the named-session store.

Not built yet (see the sessions issue); importing it is harmless.
"""
