"""Multi-turn tool use: a sandbox for model-written Python, the agent loop, and the OpenRLHF agent file."""
