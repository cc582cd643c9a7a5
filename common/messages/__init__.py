"""Typed msgpack messages, one module per channel.

Every message is a ``msgspec.Struct`` with an explicit integer ``tag``; a
channel decodes only the union of its own message types, so nothing on the
wire can name an arbitrary class and nothing is ever unpickled.
"""
