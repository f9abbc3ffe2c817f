"""The bundled demo model: synthetic scenes, their captions and questions, and its training."""
