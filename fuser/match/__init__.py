"""match: the declarative patterns (``patterns/``, one file each) and where they match.

Takes the canonical graph and the loaded patterns; returns the matches (a pattern's nodes,
inputs, outputs and parameters) and the rejections, each naming the pattern and the node.
"""
