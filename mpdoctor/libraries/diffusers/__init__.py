"""What mpdoctor knows about diffusers."""
