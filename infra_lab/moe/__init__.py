"""Mixture of experts (chapter 09): routing tokens to experts, balancing their load, and running
the experts on the tokens each one was sent."""
