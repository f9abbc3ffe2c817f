"""Turning user input (prompts, chat messages, images) into token ids and encoder inputs."""
