"""What mpdoctor knows about torch.distributed (DDP, FSDP, the ranks)."""
