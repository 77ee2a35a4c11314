"""``python -m kfrl.stages docs/architecture.md``: regenerate the stage-graph figure from the table."""
import sys

from kfrl.stages import update_graph_in

for path in sys.argv[1:]:
    print(("updated " if update_graph_in(path) else "unchanged ") + path)
