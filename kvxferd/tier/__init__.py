"""The node's KV tier: prefixes stored by engines in host memory (``host``) and on disk
(``disk``), found by key (``index``), offered to engines and peers like any offer (``offers``,
``remote``), with the events engines watch (``events``)."""
