"""Typed messages: the OpenAI HTTP surface and the planes' wire messages."""
