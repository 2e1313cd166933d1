__version__ = "0.1.0"
#: Wire protocol between daemons; peers with different values refuse each other at Hello.
PROTOCOL_VERSION = 3
