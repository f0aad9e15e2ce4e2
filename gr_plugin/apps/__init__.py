"""What the recipes run: each module takes a composed config object and does one job."""
