"""``python -m submit.logview J ...``: the same as ``tilert-submit logs J ...``."""

import argparse
import sys

from submit.logview.command import add_arguments, main

parser = argparse.ArgumentParser(prog="tilert-submit logs")
add_arguments(parser)
sys.exit(main(parser.parse_intermixed_args()))
