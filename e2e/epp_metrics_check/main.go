// Command metrics-check reads one model server's /metrics the way the endpoint picker (EPP) does and
// prints what the EPP would know about it, as JSON. It is built inside the EPP's own module (its go.mod
// and go.sum: e2e/build_epp_metrics_check.sh), so the scrape, the Prometheus text parser (legacy name
// validation), the default engine mappings and the extractor are the EPP release's own code.
//
// Usage: metrics-check HOST:PORT [ENGINE_TYPE]   (ENGINE_TYPE: the pod label's value, default vllm)
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"time"

	fwkdl "sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/interface/datalayer"
	extractor "sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/plugins/datalayer/extractor/metrics"
	source "sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/plugins/datalayer/source/metrics"
)

type result struct {
	Metrics      *fwkdl.Metrics `json:"metrics"`
	ExtractError string         `json:"extractError"`
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: metrics-check HOST:PORT [ENGINE_TYPE]")
		os.Exit(2)
	}
	engineType := "vllm"
	if len(os.Args) > 2 {
		engineType = os.Args[2]
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	ep := fwkdl.NewEndpoint(&fwkdl.EndpointMetadata{
		MetricsHost: os.Args[1],
		Labels:      map[string]string{extractor.DefaultEngineTypeLabelKey: engineType},
	}, nil)
	src, err := source.NewHTTPMetricsDataSource("http", "/metrics", "metrics-check")
	if err != nil {
		fail("data source", err)
	}
	data, err := src.Poll(ctx, ep)
	if err != nil {
		fail("scrape", err)
	}
	plugin, err := extractor.CoreMetricsExtractorFactory(extractor.MetricsExtractorType, nil, nil)
	if err != nil {
		fail("extractor", err)
	}
	out := result{}
	if err := plugin.(*extractor.Extractor).Extract(ctx, data, ep); err != nil {
		out.ExtractError = err.Error()
	}
	out.Metrics = ep.GetMetrics()
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		fail("encode", err)
	}
}

func fail(what string, err error) {
	fmt.Fprintf(os.Stderr, "metrics-check: %s: %v\n", what, err)
	os.Exit(1)
}
