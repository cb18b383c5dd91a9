"""An OpenAI-compatible endpoint that records token-faithful episodes from black-box agent harnesses."""
