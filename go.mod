module github.com/whitesky-cloud/vco-storage

go 1.26.0
