module github.com/opendsec/opendsec/sdk/go

go 1.22
