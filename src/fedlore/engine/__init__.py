"""The one round loop, its transports, sampling, client-state store and callbacks.

Nothing here knows any algorithm: it moves :class:`~fedlore.types.Broadcast` and
:class:`~fedlore.types.Reply` objects and calls the four protocol methods.
"""
