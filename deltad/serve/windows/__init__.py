"""GetDelta windows, in the order a pull meets them.

``request`` (the request checked against the log) -> ``decide`` (which window a cursor gets) ->
``caps`` (the release cap) -> ``source`` (generation diff, rollback, cache or build) -> ``plan``
(``parts``, ``merged``, ``header``, ``encode``, ``packed``) -> ``encoded`` / ``cache`` (a window
streamed while built, shared by readers) -> ``prefetch`` / ``streams`` -> ``getdelta`` (the
handler). ``gendiff``, ``rollback`` and ``statediff`` build the windows that compare two states.
"""
