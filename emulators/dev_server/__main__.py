"""``python -m emulators.dev_server --model DIR [--host] [--port] ...``: the dev server's CLI (cli.py `main`)."""

from emulators.dev_server.cli import main

if __name__ == "__main__":
    main()
