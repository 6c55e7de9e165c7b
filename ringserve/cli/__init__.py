"""The `ringserve` command: generate, chat, serve, bench and the calibrations (main.py), and
the interactive chat (chat.py). The top layer: may import anything in the package.
"""
