algorithm tabs
	"Tabs indent and separate."
	baseline	group_mean
	normalizer		group_std(eps=1e-6,	unbiased=false)
  	 objective ppo	
