"""Peer engines the bench compares against, built and run locally (llama.cpp's llama-server)."""
