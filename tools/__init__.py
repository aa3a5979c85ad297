"""Lab tools: measurements, research scripts and the GPU check bundle, which the sparq-cpp package does not
install or import. They run from a checkout, at its root, with the environment of `make setup`:

    .venv/bin/python -m tools.fidelity --help

They import the package (sparq_cpp) and each other (tools.*); nothing in sparq_cpp imports them
(tests/test_layering.py).
"""
